# Registers the harness's stage plugin for every pytest run from the project root;
# pytester drives the plugin's own tests.
pytest_plugins = ["dppo_harness.pytest_plugin.hooks", "pytester"]
