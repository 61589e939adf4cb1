# Registers the harness's stage plugin for every pytest run from the project root.
pytest_plugins = ["dppo_harness.pytest_plugin"]
