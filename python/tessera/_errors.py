"""The exceptions tessera raises.

Every error of the C++ library is a status: a code and a message naming the key, the box, the
rank and the file. At the Python boundary it becomes an exception whose message is the status
message, unchanged, and whose class follows the code:

======================  ========================================  ==========================
status code             exception                                 also an instance of
======================  ========================================  ==========================
InvalidArgument         InvalidArgumentError                      ValueError
OutOfRange              InvalidArgumentError                      ValueError
NotFound (of keys)      MissingKeysError                          ValueError
NotFound (of files)     NotFoundError                             FileNotFoundError (OSError)
AlreadyExists           AlreadyExistsError                        FileExistsError (OSError)
FailedPrecondition      FailedPreconditionError                   OSError
IOError                 StorageError                              OSError
DataLoss                CorruptCheckpointError                    RuntimeError
Unimplemented           UnimplementedError                        NotImplementedError
Internal                InternalError                             RuntimeError
Aborted                 CommError                                 RuntimeError
DeadlineExceeded        CommTimeoutError                          CommError, TimeoutError
======================  ========================================  ==========================

All of them derive from :class:`tessera.Error`, which carries ``code`` (the status code name,
e.g. ``"DataLoss"``) and ``status_code`` (its number, see include/tessera/status.h).

Messages speak Python: where the library names a C++ option ("set LoadOptions::missing_keys =
kSkip"), the exception names the Python argument that sets it ("pass strict=False"). Both the
class and the wording follow the typed detail of the status (``error.detail``, an
:class:`ErrorDetail`: its kind, keys, options, file and offset), never its text.

Messages hold no control character raw: a key or a path from a checkpoint may carry terminal
escape sequences, so control characters (U+0000..U+001F, U+007F..U+009F) appear as ``\\xNN``,
the bytes of their UTF-8 encoding, as in the library's own messages and the CLI's tables.
"""

import dataclasses
import re
import warnings
from typing import Any, Mapping, Optional, Tuple

# Numbers of include/tessera/status.h (StatusCode); part of the bindings' contract.
_OK = 0
_INVALID_ARGUMENT = 1
_NOT_FOUND = 2
_ALREADY_EXISTS = 3
_FAILED_PRECONDITION = 4
_OUT_OF_RANGE = 5
_DATA_LOSS = 6
_IO_ERROR = 7
_UNIMPLEMENTED = 8
_INTERNAL = 9
_ABORTED = 10
_DEADLINE_EXCEEDED = 11


class Error(Exception):
    """Base of every exception tessera raises for a failed library call."""

    code = "Unknown"
    status_code = -1
    #: The typed facts of the failure (ErrorDetail), or None when the library gave none.
    detail: "Optional[ErrorDetail]" = None

    def __str__(self) -> str:
        return Exception.__str__(self)


class InvalidArgumentError(Error, ValueError):
    """The caller's input is wrong: a shape, dtype, box, key or option."""


class MissingKeysError(InvalidArgumentError):
    """A load asked for keys the checkpoint lacks (``strict=False`` skips them)."""


class NotFoundError(Error, FileNotFoundError):
    """A file or directory does not exist."""


class AlreadyExistsError(Error, FileExistsError):
    """A file or directory already exists."""


class FailedPreconditionError(Error, OSError):
    """The storage is not in a state the call can work with, e.g. a directory holding no
    committed checkpoint."""


class StorageError(Error, OSError):
    """The operating system refused an operation."""


class CorruptCheckpointError(Error, RuntimeError):
    """Checksum mismatch, truncated or missing data file, corrupt manifest."""


class UnimplementedError(Error, NotImplementedError):
    """E.g. a manifest of a newer format version."""


class InternalError(Error, RuntimeError):
    """A bug in tessera."""


class CommError(Error, RuntimeError):
    """A collective gave up: another rank failed or aborted."""


class CommTimeoutError(CommError, TimeoutError):
    """A collective timed out waiting for its peers."""


for _cls in (Error, InvalidArgumentError, MissingKeysError, NotFoundError, AlreadyExistsError,
             FailedPreconditionError, StorageError, CorruptCheckpointError, UnimplementedError,
             InternalError, CommError, CommTimeoutError):
    _cls.__module__ = "tessera"

_CLASSES = {
    _INVALID_ARGUMENT: InvalidArgumentError,
    _NOT_FOUND: NotFoundError,
    _ALREADY_EXISTS: AlreadyExistsError,
    _FAILED_PRECONDITION: FailedPreconditionError,
    _OUT_OF_RANGE: InvalidArgumentError,
    _DATA_LOSS: CorruptCheckpointError,
    _IO_ERROR: StorageError,
    _UNIMPLEMENTED: UnimplementedError,
    _INTERNAL: InternalError,
    _ABORTED: CommError,
    _DEADLINE_EXCEEDED: CommTimeoutError,
}

# Numbers of include/tessera/status.h (StatusDetail::Kind); part of the bindings' contract.
_DETAIL_KINDS = {0: "none", 1: "missing_keys", 2: "unexpected_keys", 3: "shape_mismatch",
                 4: "dtype_mismatch", 5: "not_covered", 6: "corruption", 7: "bad_option"}


@dataclasses.dataclass(frozen=True)
class ErrorDetail:
    """The typed facts of a failure (C++ StatusDetail), beside its message.

    ``kind``: "missing_keys", "unexpected_keys", "shape_mismatch", "dtype_mismatch",
    "not_covered", "corruption", "bad_option" or "none". ``keys``: the keys concerned.
    ``options``: the options the message names, as Python arguments; ``advice``: the advice the
    message ends with in parentheses, as worded there ("" when none). ``file`` and ``offset``:
    where corrupt bytes are (offset -1 when unknown)."""

    kind: str = "none"
    keys: Tuple[str, ...] = ()
    options: Tuple[str, ...] = ()
    advice: str = ""
    file: str = ""
    offset: int = -1


ErrorDetail.__module__ = "tessera"

# The advice of the library's messages, by the option that would change the outcome (the first
# of StatusDetail::options), as the Python argument that sets it.
_PYTHON_ADVICE = {
    "LoadOptions::missing_keys": "pass strict=False to load the rest",
    "LoadOptions::unexpected_keys": "pass strict=False to load only the keys asked for",
    "allow_shape_mismatch":
        "pass allow_shape_mismatch=True to its ShardedTensor to load the common part",
    "LoadOptions::cast_dtypes": "pass cast_dtypes=True to convert between float dtypes",
    "partial": "pass partial=True to its ShardedTensor if that is intended",
}


def _python_option(option: str) -> str:
    """A C++ option as the Python keyword argument that sets it: "LoadOptions::num_io_threads"
    -> "num_io_threads"."""
    return option.split("::", 1)[1] if "::" in option else option


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def escape_controls(text):
    """`text` with every control character as \\xNN (its UTF-8 bytes), as core/utf8.h's
    EscapeControlCharacters writes them: a message never carries a terminal escape raw."""
    return _CONTROL.sub(lambda m: "".join(f"\\x{b:02x}" for b in m.group().encode()), text)


def _python_advice(detail: Mapping[str, Any]) -> str:
    """The advice of a StatusDetail's fields in Python's words ("" when it has none)."""
    options = list(detail.get("options", ()))
    advice = str(detail.get("advice", ""))
    if advice and options and options[0] in _PYTHON_ADVICE:
        return _PYTHON_ADVICE[options[0]]
    for option in options:
        advice = advice.replace(option, _python_option(option))
    return advice


def python_wording(message: str, detail: Optional[Mapping[str, Any]]) -> str:
    """`message` with the C++ options its `detail` names (StatusDetail::options, ::advice)
    replaced by the Python arguments that set them."""
    if not detail:
        return message
    advice = str(detail.get("advice", ""))
    if advice:
        message = message.replace(f"({advice})", f"({_python_advice(detail)})")
    for option in detail.get("options", ()):
        message = message.replace(option, _python_option(option))
    return message


def reword_advice(error: "Error", advice: str) -> "Error":
    """`error` with the advice its message ends with (error.detail.advice) replaced by
    `advice`, for callers that speak another API's words (tessera.megatron); unchanged when
    its detail has no advice."""
    detail = error.detail
    if detail is None or not detail.advice:
        return error
    error.args = (str(error).replace(f"({detail.advice})", f"({advice})"),)
    error.detail = dataclasses.replace(detail, advice=advice)
    return error


class PartialLoadWarning(UserWarning):
    """A load with strict=False left keys out: asked for but absent from the checkpoint, or
    in the checkpoint but asked for by no rank. The LoadReport lists them."""


PartialLoadWarning.__module__ = "tessera"


def warn_partial_load(function, missing, unexpected, stacklevel=3):
    """The warning of a non-strict load that left `missing` (asked for, absent) and
    `unexpected` (saved, asked for by no rank) keys out; nothing when both are empty."""
    if not missing and not unexpected:
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} asked for but absent from the checkpoint "
                     f"({_key_list(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} in the checkpoint but asked for by no rank "
                     f"({_key_list(unexpected)})")
    n = len(missing) + len(unexpected)
    warnings.warn(f"{function}: {n} key{'s' if n != 1 else ''} not loaded: " + "; ".join(parts),
                  PartialLoadWarning, stacklevel=stacklevel)


def _key_list(keys, limit=5):
    shown = ", ".join(repr(k) for k in list(keys)[:limit])
    return shown + (f", ... ({len(keys)} keys)" if len(keys) > limit else "")


def from_status(status_code: int, code_name: str, message: str,
                detail: Optional[Mapping[str, Any]] = None) -> "Error":
    """The exception (not raised) for a status and its detail (a dict of StatusDetail's
    fields, or None); called by the extension module. The class follows the code, and the
    detail's kind where it says more (a NotFound of keys is a MissingKeysError); the message
    speaks Python where the detail names options."""
    message = escape_controls(python_wording(message, detail))
    cls = _CLASSES.get(status_code, InternalError)
    kind = _DETAIL_KINDS.get(int(detail.get("kind", 0)), "none") if detail else "none"
    if kind == "missing_keys":
        cls = MissingKeysError
    error = cls(message)
    error.code = code_name
    error.status_code = status_code
    error.detail = None if not detail else ErrorDetail(
        kind=kind, keys=tuple(detail.get("keys", ())),
        options=tuple(_python_option(o) for o in detail.get("options", ())),
        advice=_python_advice(detail),
        file=str(detail.get("file", "")), offset=int(detail.get("offset", -1)))
    return error


def as_error(error: Exception) -> "Error":
    """`error` as a tessera.Error: itself, or (a Python exception raised while preparing a call,
    about the caller's input) an InvalidArgumentError naming its type, caused by it."""
    if isinstance(error, Error):
        return error
    wrapped = from_status(_INVALID_ARGUMENT, "InvalidArgument",
                          f"{type(error).__name__}: {error}")
    wrapped.__cause__ = error
    return wrapped


def invalid_argument(message):
    """An InvalidArgumentError raised by the Python layer itself."""
    return from_status(_INVALID_ARGUMENT, "InvalidArgument", message)


def corrupt_checkpoint(message):
    """A CorruptCheckpointError (DataLoss) raised by the Python layer itself."""
    return from_status(_DATA_LOSS, "DataLoss", message)
