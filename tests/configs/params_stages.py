"""Stages whose ``Params`` models take their keys in pydantic's several ways: each key they
take must pass the check for misspelt params, and only those."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Annotated

from pydantic import (
    AliasChoices,
    AliasPath,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    RootModel,
    field_validator,
)
from pydantic.alias_generators import to_camel

from pipeline import Context, Stage
from stages.text import Text


class _Echo(Stage):
    async def process(self, text: Text, ctx: Context) -> Text:
        return text


class Choices(_Echo):
    class Params(BaseModel):
        max_tokens: int = Field(16, validation_alias=AliasChoices("max_tokens", "max_new"))


class Nested(_Echo):
    class Params(BaseModel):
        size: int = Field(1, validation_alias=AliasPath("image", "size"))


class Camel(_Echo):
    class Params(BaseModel):
        model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True)
        max_tokens: int = 16


class Mapping(_Echo):
    class Params(RootModel[dict[str, int]]):
        pass


class AliasOnly(_Echo):
    class Params(BaseModel):
        max_tokens: int = Field(16, alias="maxTokens")


class Kinds(_Echo):
    class Params(BaseModel):
        count: int = 1
        ratio: float = 0.5
        name: str = ""
        where: Path = Path(".")
        on: bool = False
        maybe: int | None = None


class Lax(_Echo):
    class Params(BaseModel):
        model_config = ConfigDict(strict=False)
        count: int = 1


def _thousands(value: object) -> object:
    return int(value[:-1]) * 1000 if isinstance(value, str) else value


class Loose(_Echo):
    class Params(BaseModel):
        loose: int = Field(1, strict=False)
        size: int = 0
        timeout: timedelta = timedelta(0)
        budget: Annotated[int, BeforeValidator(_thousands)] = 0

        @field_validator("size", mode="before")
        @classmethod
        def _kilo(cls, value: object) -> object:
            return int(value[:-1]) * 1000 if isinstance(value, str) else value
