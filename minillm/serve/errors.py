"""Errors answered with OpenAI's JSON body ``{"error": {"message", "type", "param", "code"}}``."""
from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               404: "invalid_request_error", 405: "invalid_request_error",
               413: "invalid_request_error", 500: "server_error",
               503: "service_unavailable_error"}


class APIError(Exception):
    """An error answered with OpenAI's JSON body."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        error = {"message": self.message, "type": ERROR_TYPES.get(self.status, "server_error"),
                 "param": self.param, "code": self.code}
        return JSONResponse({"error": error}, status_code=self.status)
