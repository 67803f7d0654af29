"""Lightning training: modules, data modules, the ``diffmm fit|validate|test|predict`` CLI (:mod:`diffmm.train.cli`)."""
from diffmm.train.base import TrainModule
from diffmm.train.checkpoint_io import AtomicCheckpointIO
from diffmm.train.clip_module import CLIPModule
from diffmm.train.datamodules import ImageTextDataModule, RecallDataModule, ShardDataModule, TextDataModule
from diffmm.train.errors import ConfigError
from diffmm.train.lit import LiTModule, clear_image_caches
from diffmm.train.lm_module import LMModule
from diffmm.train.losses import ContrastiveLoss
from diffmm.train.optim import WarmupCosine, WarmupCosineLR, adamw, param_groups
from diffmm.train.resume import ResumableLoader
from diffmm.train.strategies import BlockFSDPStrategy

__all__ = ["AtomicCheckpointIO", "BlockFSDPStrategy", "CLIPModule", "ConfigError", "ContrastiveLoss",
           "ImageTextDataModule", "LMModule", "LiTModule", "RecallDataModule", "ResumableLoader", "ShardDataModule",
           "TextDataModule", "TrainModule", "WarmupCosine", "WarmupCosineLR", "adamw", "clear_image_caches",
           "param_groups"]
