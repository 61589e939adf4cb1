"""The service wait: one policy for every service call (bounded waits, queue pauses seen, capacity
give-up, hang stop) and its evidence. In the order a wait uses them: `policy` (settings, stops and capacity refusals),
`watch` (what the service says about a queue) and `waiter` (waited clients and futures, one wait
under the policy, and its evidence: result.json's `service_wait` block and the stopped run).
"""
