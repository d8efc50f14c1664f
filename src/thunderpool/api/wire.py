"""What every API module shares at the wire: reading a body into its pydantic model (bad JSON
and wrong types are 400s naming the field), and strict request models that refuse unknown
fields, so that no parameter of another API's is ever silently ignored."""

from __future__ import annotations

import json
import logging
from typing import TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.requests import Request

from thunderpool.api.errors import APIError, bad_request, from_validation
from thunderpool.body import API_LIMIT, BodyError, read_body

R = TypeVar("R", bound=BaseModel)
log = logging.getLogger("thunderpool.api")


class Strict(BaseModel):
    """A request part that refuses fields it does not know: a 400 names the field."""

    model_config = ConfigDict(extra="forbid", strict=True)


async def parse(request: Request, model: type[R]) -> R:
    try:
        body = await read_body(request, API_LIMIT, log)
    except BodyError as e:
        raise APIError(e.status, e.message) from None
    try:
        data = json.loads(body, parse_float=_number, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="json_invalid") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation(e) from e


def _number(text: str) -> float | int:
    # JSON Schema counts 16.0 as an integer, and the schema is what clients read: an integral
    # number is an int here (strict float fields take ints; int fields refuse 16.5).
    value = float(text)
    return int(value) if value.is_integer() and abs(value) < 2**53 else value


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")
