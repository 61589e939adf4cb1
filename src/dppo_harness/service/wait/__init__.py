"""The service wait: one policy for every service call (bounded waits, queue pauses seen,
capacity give-up, hang stop) and its evidence.

Modules, in the order a wait uses them: `policy` (the WaitPolicy settings and the stops, all
ServiceStopped), `watch` (the SDK queue-state observers: what the service says about a client's
queue), `clients` (waited clients and futures: every client the harness hands out, and every future
it returns), `waiter` (ServiceWaiter: one wait under the policy, the pauses and the stop it
records) and `evidence` (result.json's `service_wait` block, its snapshots and the stopped run's
result).
"""
