"""HTTP side of the embedded server: the Tinker SDK 0.25 wire protocol over a local engine
(`app.build_app`; docs/local-server.md "HTTP side")."""
