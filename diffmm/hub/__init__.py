"""Loading and exporting weights: checkpoint formats, converters and safe file reading."""
from diffmm.hub.checkpoint import DamagedFileError, atomic_save, check_state_dict, load_state_file, strip_prefix
from diffmm.hub.formats import CheckpointFormat, list_formats, load_pretrained, register_format

__all__ = ["DamagedFileError", "atomic_save", "check_state_dict", "load_state_file", "strip_prefix", "CheckpointFormat", "list_formats",
           "load_pretrained", "register_format"]
