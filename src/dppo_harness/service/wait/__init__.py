"""The service wait: `policy` (settings, stops, capacity refusals), `watch` (what the service says
about a queue) and `waiter` (waited clients and futures, each wait under the policy, its evidence)."""
