"""What refusing an adapter raises (no torch: the engine loop and the server catch these)."""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter refused, or a name refused; `field` is the request field or config key at fault."""

    def __init__(self, message: str, field: str = "lora_path") -> None:
        super().__init__(message)
        self.field = field


class UnknownLoRA(LookupError):
    """No adapter of this name is loaded (a request's model, or an unload)."""

    def __init__(self, name: str) -> None:
        super().__init__(f"LoRA adapter {name!r} is not loaded")
        self.name = name


class LoRAInUse(RuntimeError):
    """An unload refused: unfinished requests still use the adapter (they finish first)."""

    def __init__(self, name: str, users: int) -> None:
        super().__init__(
            f"LoRA adapter {name!r} is in use by {users} unfinished request{'s' if users != 1 else ''}; "
            "unload it once they finish"
        )
        self.name, self.users = name, users
