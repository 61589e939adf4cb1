"""The embedded server's user-facing error (a bad request; category "user" on the wire).

Its own module so the engine, the loss registry and the HTTP app share it without an import cycle.
"""


class UserError(Exception):
    """Bad request from the client; maps to an error with category "user"."""


class SpindleError(Exception):
    """An HTTP error in Spindle's shape, `{"error": <code>, "message": <text>}` (spindle profile;
    Spindle's src/spindle/control_plane/http.py maps its exceptions to these codes)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
