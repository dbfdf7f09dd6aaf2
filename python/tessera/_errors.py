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
kSkip"), the exception names the Python argument that sets it ("pass strict=False").

Messages hold no control character raw: a key or a path from a checkpoint may carry terminal
escape sequences, so control characters (U+0000..U+001F, U+007F..U+009F) appear as ``\\xNN``,
the bytes of their UTF-8 encoding, as in the library's own messages and the CLI's tables.
"""

import re
import warnings

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

# The one NotFound the library returns for keys rather than files (src/plan/load_plan.cc).
_MISSING_KEYS_TEXT = " has no key "


# Hints of library messages that name C++ options -> the Python arguments that set them.
_PYTHON_HINTS = (
    (" (set LoadOptions::missing_keys = kSkip to load the rest)",
     " (pass strict=False to load the rest)"),
    (" (set LoadOptions::unexpected_keys = kSkip to ignore)",
     " (pass strict=False to load only the keys asked for)"),
    (" (set allow_shape_mismatch to load the common part)",
     " (pass allow_shape_mismatch=True to its ShardedTensor to load the common part)"),
    (" (set LoadOptions::cast_dtypes to convert between float dtypes)",
     " (pass cast_dtypes=True to convert between float dtypes)"),
    (" (mark the tensor partial if that is intended)",
     " (pass partial=True to its ShardedTensor if that is intended)"),
)
# Any other option named as a C++ struct field: "LoadOptions::num_io_threads" -> the keyword
# argument "num_io_threads".
_OPTION_FIELD = re.compile(r"\b(?:Save|Load|AsyncSave|Verify)Options::(\w+)")


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def escape_controls(text):
    """`text` with every control character as \\xNN (its UTF-8 bytes), as core/utf8.h's
    EscapeControlCharacters writes them: a message never carries a terminal escape raw."""
    return _CONTROL.sub(lambda m: "".join(f"\\x{b:02x}" for b in m.group().encode()), text)


def python_wording(message):
    """`message` with C++ option names replaced by the Python arguments that set them."""
    for cpp, python in _PYTHON_HINTS:
        message = message.replace(cpp, python)
    return _OPTION_FIELD.sub(r"\1", message)


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


def from_status(status_code, code_name, message):
    """The exception (not raised) for a status; called by the extension module."""
    message = escape_controls(python_wording(message))
    cls = _CLASSES.get(status_code, InternalError)
    if status_code == _NOT_FOUND and _MISSING_KEYS_TEXT in message:
        cls = MissingKeysError
    error = cls(message)
    error.code = code_name
    error.status_code = status_code
    return error


def invalid_argument(message):
    """An InvalidArgumentError raised by the Python layer itself."""
    return from_status(_INVALID_ARGUMENT, "InvalidArgument", message)


def corrupt_checkpoint(message):
    """A CorruptCheckpointError (DataLoss) raised by the Python layer itself."""
    return from_status(_DATA_LOSS, "DataLoss", message)
