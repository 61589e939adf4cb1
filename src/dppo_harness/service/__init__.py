"""Service layer: clients, the one wait policy, connectivity, served-model identity, secrets."""
