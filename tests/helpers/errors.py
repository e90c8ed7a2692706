"""The OpenAI error shape: every error the server sends must look exactly like OpenAI's, so
clients written for OpenAI (the official SDKs among them) can read it."""

from __future__ import annotations

from typing import Any

import httpx

ERROR_FIELDS = {"message", "type", "param", "code"}


def check_error_body(body: Any) -> dict[str, Any]:
    """The `error` object of `{"error": {message, type, param, code}}`; asserts that shape exactly.

    The message must say something (and never leak a traceback), type is a non-empty string,
    param and code are strings or null.
    """
    assert isinstance(body, dict) and set(body) == {"error"}, body
    err = body["error"]
    assert isinstance(err, dict) and set(err) == ERROR_FIELDS, err
    assert isinstance(err["message"], str) and err["message"] and "Traceback" not in err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["param"] is None or isinstance(err["param"], str), err
    assert err["code"] is None or isinstance(err["code"], str), err
    return err


class _Unchecked:
    def __repr__(self) -> str:
        return "UNCHECKED"


UNCHECKED: Any = _Unchecked()
"""Default of `param` and `code`: not compared (None would mean "must be null")."""


def assert_error(resp: httpx.Response, status: int | None = None, *, contains: str | None = None,
                 param: str | None = UNCHECKED, code: str | None = UNCHECKED) -> dict[str, Any]:
    """`resp` is an error in OpenAI's shape with this `status` (any 4xx when None); returns the
    `error` object. `contains`: a piece of text the message must hold (it tells the user what to do);
    `param`, `code`: the exact values those fields must have, when given."""
    if status is None:
        assert 400 <= resp.status_code < 500, (resp.status_code, resp.text[:500])
    else:
        assert resp.status_code == status, (resp.status_code, resp.text[:500])
    err = check_error_body(resp.json())
    if contains is not None:
        assert contains in err["message"], err["message"]
    if param is not UNCHECKED:
        assert err["param"] == param, err
    if code is not UNCHECKED:
        assert err["code"] == code, err
    return err
