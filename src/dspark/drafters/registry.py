"""The drafter kinds, in one table, and turning a user's ``--drafter`` value into a drafter.

Every lookup of a drafter kind goes through the table in ``_table`` (``kind_entry``,
``model_kind_entry``, ``checkpoint_kind``): training reads a kind's config, model and loss
classes from it, decoding its loader, and a checkpoint folder is dispatched on
``architectures[0]`` (as DeepSpec's eval does) against the exact architecture names of
each row.

Accepted ``--drafter`` values: ``none`` (plain decoding), ``prompt-lookup``, a DSpark /
DFlash / Eagle3 checkpoint folder, or any HF causal-LM folder (an independent draft
model, the draft-lm kind).

The kinds' packages import torch; they are imported on the first lookup, so building
the command-line parsers stays fast.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from dspark.drafters.options import DraftingOptions
from dspark.errors import ModelLoadError

if TYPE_CHECKING:
    from dspark.drafters.base import Drafter

BUILTIN = ("none", "prompt-lookup")


class DrafterKind(str, enum.Enum):
    """The trainable drafter kinds; the value is the name in configs and on the command line."""

    DSPARK = "dspark"
    DFLASH = "dflash"  # DSpark's backbone without the sequential and confidence heads
    EAGLE3 = "eagle3"
    DRAFT_LM = "draft-lm"  # an independent causal LM (layer-pruned target, distilled)

    def __str__(self) -> str:
        return self.value


#: kind names, for ``--drafter`` choices and config validation (no import of the kinds' packages)
KIND_NAMES = tuple(kind.value for kind in DrafterKind)


@dataclass(frozen=True)
class KindEntry:
    """One row of the table."""

    kind: DrafterKind
    config_class: type  # the model config dataclass (its fields are the training config's ``model.*`` keys)
    make_config: Callable[..., Any]  # config_class itself, or a preset constructor (DSparkConfig.dflash)
    model_class: type  # nn.Module: from_target(target, config), from_checkpoint(folder, target), forward -> outputs
    loss_class: type  # nn.Module: loss_class(config)(model, outputs, sample) -> (loss, metrics)
    load_drafter: Callable[[Path, Any, DraftingOptions], "Drafter"]  # a checkpoint folder -> a decoding Drafter
    architectures: tuple[str, ...]  # exact ``architectures[0]`` names of checkpoints that load as this kind


@functools.cache
def _table() -> dict[DrafterKind, KindEntry]:
    from dspark.drafters.checkpoint import arch_names
    from dspark.drafters.draft_lm import drafter as draft_lm_drafter
    from dspark.drafters.draft_lm.config import DraftLMConfig
    from dspark.drafters.draft_lm.loss import DraftLMLoss
    from dspark.drafters.draft_lm.model import HF_ARCHITECTURES, DraftLMModel
    from dspark.drafters.dspark import drafter as dspark_drafter
    from dspark.drafters.dspark.config import DSparkConfig
    from dspark.drafters.dspark.loss import DSparkLoss
    from dspark.drafters.dspark.model import DSparkModel
    from dspark.drafters.eagle3 import drafter as eagle3_drafter
    from dspark.drafters.eagle3.config import Eagle3Config
    from dspark.drafters.eagle3.loss import Eagle3Loss
    from dspark.drafters.eagle3.model import Eagle3Model

    # ours and DeepSpec's (<Prefix>DSparkModel, <Prefix>DFlashModel), SpecForge's DFlash (DFlashDraftModel)
    dspark_names = arch_names("DSparkModel") + arch_names("DFlashModel") + ("DSparkDraftModel", "DFlashDraftModel")
    # ours and DeepSpec's (<Prefix>Eagle3Model), SpecForge's (LlamaForCausalLMEagle3)
    eagle3_names = arch_names("Eagle3Model") + ("Eagle3DraftModel", "LlamaForCausalLMEagle3")
    dspark = KindEntry(DrafterKind.DSPARK, DSparkConfig, DSparkConfig, DSparkModel, DSparkLoss,
                       dspark_drafter.load_with_options, dspark_names)
    return {
        DrafterKind.DSPARK: dspark,
        # a DFlash checkpoint is a DSpark checkpoint without heads: it is found under dspark's names
        DrafterKind.DFLASH: KindEntry(DrafterKind.DFLASH, DSparkConfig, DSparkConfig.dflash, DSparkModel,
                                      DSparkLoss, dspark_drafter.load_with_options, ()),
        DrafterKind.EAGLE3: KindEntry(DrafterKind.EAGLE3, Eagle3Config, Eagle3Config, Eagle3Model, Eagle3Loss,
                                      eagle3_drafter.load_with_options, eagle3_names),
        # any other architecture is taken for an HF causal LM (CHECKPOINT_FALLBACK)
        DrafterKind.DRAFT_LM: KindEntry(DrafterKind.DRAFT_LM, DraftLMConfig, DraftLMConfig, DraftLMModel,
                                        DraftLMLoss, draft_lm_drafter.load_with_options,
                                        tuple(HF_ARCHITECTURES.values())),
    }


#: the kind of a checkpoint whose architecture no row names: an HF causal-LM folder
CHECKPOINT_FALLBACK = DrafterKind.DRAFT_LM


def kind_entry(kind: DrafterKind | str) -> KindEntry:
    """The table row of ``kind`` (a ``DrafterKind`` or its name)."""
    try:
        kind = DrafterKind(kind)
    except ValueError:
        raise ValueError(f"unknown drafter kind {kind!r}; one of {', '.join(KIND_NAMES)}") from None
    return _table()[kind]


def model_kind_entry(model) -> KindEntry:
    """The table row of a drafter model (DSpark's row for a DFlash model: they share classes and loss)."""
    for entry in _table().values():
        if type(model) is entry.model_class:
            return entry
    raise ValueError(f"{type(model).__name__} is not the model class of any drafter kind ({', '.join(KIND_NAMES)})")


def checkpoint_kind(path: Path) -> DrafterKind:
    """The kind whose architecture names hold the folder's ``architectures[0]`` (DFlash checkpoints are dspark)."""
    from dspark.modeling.weights import read_config

    arch = (read_config(path).get("architectures") or [""])[0]
    for entry in _table().values():
        if arch in entry.architectures:
            return entry.kind
    return CHECKPOINT_FALLBACK


def load_drafter(spec: str, target, options: DraftingOptions | None = None) -> Drafter:
    """The drafter ``spec`` names, for ``target``, drafting as ``options`` say (see ``DraftingOptions``)."""
    options = options or DraftingOptions()
    if spec == "none":
        from dspark.drafters.base import NoDrafter

        return NoDrafter(target.vocab_size)
    if spec == "prompt-lookup":
        from dspark.drafters.prompt_lookup import PromptLookupDrafter

        return PromptLookupDrafter(target.vocab_size, options.block_size or 7)
    path = Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"--drafter {spec!r}: not one of {', '.join(BUILTIN)} and no such folder"
        )
    drafter = kind_entry(checkpoint_kind(path)).load_drafter(path, target, options)
    if options.hybrid:  # prompt lookup where the context repeats itself, this drafter elsewhere
        from dspark.drafters.hybrid import HybridDrafter

        drafter = HybridDrafter(drafter, target.vocab_size, min_ngram=options.hybrid_min_ngram)
    return drafter
