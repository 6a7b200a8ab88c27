"""vLLM's request models as the routes take their bodies: a body that does not fit is always the caller's 400.

pydantic turns a ``ValueError`` raised in a validator into a validation error (a 400 naming the field), but lets
anything else through. Some of vLLM's own validators run before the fields are checked and use what they are
given as what it should be: ``{"messages": 5}`` (or ``null``, ``true``) reached ``check_system_message_content_type``
as an int (``TypeError``), ``{"structured_outputs": 5}`` was read with ``.get`` (``AttributeError``), and each came
out as an internal error, a 500 for the caller's mistake. Each model here is vLLM's own, with one validator around
all of vLLM's: such an error from inside (``MISFIT_ERRORS``) becomes a validation error naming the first field
whose value is not of its declared type (found by checking each field alone, on this error path only), or saying
the body does not fit when none is. Everything else (the fields, vLLM's validators and words, ``isinstance`` against vLLM's classes) is
vLLM's.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, TypeAdapter, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest

__all__ = ["Chat", "Completion", "Detokenize", "Generate", "MISFIT_ERRORS", "Tokenize", "checked", "misfit"]

# what a validator raises when the value it reads is not of the type it expects
MISFIT_ERRORS = (TypeError, AttributeError, KeyError, IndexError)


def misfit(model: type[BaseModel], data: Any) -> tuple[str, str] | None:
    """The first field of ``data`` whose value does not validate as ``model`` declares it, with pydantic's words;
    None when every field does (or ``data`` is not an object, which the model's own check words)."""
    if not isinstance(data, dict):
        return None
    for name, value in data.items():
        field = model.model_fields.get(name)
        if field is None or field.annotation is None:
            continue
        try:
            TypeAdapter(field.annotation).validate_python(value)
        except ValidationError as exc:
            return name, str(exc.errors()[0].get("msg", exc))
        except Exception:  # noqa: BLE001 - an annotation pydantic cannot check alone: look at the next field
            continue
    return None


@cache
def checked(model: type[BaseModel]) -> type[BaseModel]:
    """``model`` with its validators' ``MISFIT_ERRORS`` answered as validation errors (see the module's docstring)."""

    class Checked(model):  # type: ignore[valid-type, misc]
        @model_validator(mode="wrap")
        @classmethod
        def _types_fit(cls, data: Any, handler: Any) -> Any:
            try:
                return handler(data)
            except MISFIT_ERRORS as exc:
                bad = misfit(model, data)
                if bad is not None:
                    raise PydanticCustomError("field_type", "{field}: {why}", {"field": bad[0], "why": bad[1]}) from None
                raise PydanticCustomError("body_type", "the request body does not fit {model}: {why}",
                                          {"model": model.__name__, "why": str(exc)}) from None

    Checked.__name__ = Checked.__qualname__ = model.__name__
    Checked.__doc__ = model.__doc__
    return Checked


if TYPE_CHECKING:  # to a type checker they are vLLM's models, which they are but for the one validator
    Completion, Chat, Detokenize, Generate = CompletionRequest, ChatCompletionRequest, DetokenizeRequest, GenerateRequest
    Tokenize = TokenizeCompletionRequest | TokenizeChatRequest
else:
    Completion = checked(CompletionRequest)
    Chat = checked(ChatCompletionRequest)
    Tokenize = checked(TokenizeCompletionRequest) | checked(TokenizeChatRequest)
    Detokenize = checked(DetokenizeRequest)
    Generate = checked(GenerateRequest)
