"""The fake torch's dynamo: only what gpualloc asks of it (``skip_code``)."""

from . import eval_frame  # noqa: F401 - imported with dynamo, as in torch
