"""The error of the multimodal data: a ``ValueError`` (megatrain's user-mistake type, printed as one
``error: ...`` line by :func:`megatrain.errors.user_errors_exit`) that names the input and line."""

from __future__ import annotations

__all__ = ["MultimodalDataError"]


class MultimodalDataError(ValueError):
    """One bad input (a jsonl line, an image, a shard sample): ``where`` is ``FLAG FILE:LINE``, ``kind``
    a short word for counting skipped samples (``image``, ``json``, ``conversation``, ``length``)."""

    def __init__(self, message: str, where: str | None = None, kind: str = "sample"):
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where
        self.kind = kind
