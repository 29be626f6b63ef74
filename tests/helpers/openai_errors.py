"""An error answer in OpenAI's shape, checked the one way every REST test checks it."""

from __future__ import annotations

import httpx


def openai_error(response: httpx.Response, status: int) -> dict:
    """The ``error`` object of ``response``, after checking its status and that the object
    has exactly OpenAI's fields."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error
