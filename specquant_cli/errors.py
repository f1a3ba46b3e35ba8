"""The small exception family raised by core code and translated once at the CLI edge."""


class SpecquantError(Exception):
    """Base of every error meant for the user: one line, no traceback."""


class InputError(SpecquantError):
    """Bad user input: a path, a prompt, an option value."""


class ModelFileError(InputError):
    """A file that is not a usable GGUF model."""


class FamilyError(SpecquantError):
    """A model family that is missing, incomplete or does not match its manifest."""


class ResourceError(SpecquantError):
    """Not enough disk, RAM or VRAM for what was asked."""


class LlamaError(SpecquantError):
    """llama.cpp refused: a failed load, decode or quantize."""


class VocabMismatchError(SpecquantError):
    """A draft model whose vocabulary differs from its parent's."""
