"""The base of every config section (config.py and the sections split from it): an unknown key
is refused, not ignored -- a typo in rtrl.toml is an error naming the key -- and a value set
after loading is validated like one read from the file."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)
