"""The embedded server's user-facing error (a bad request; category "user" on the wire).

Its own module so the engine, the loss registry and the HTTP app share it without an import cycle.
"""


class UserError(Exception):
    """Bad request from the client; maps to an error with category "user"."""
