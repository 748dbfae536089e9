"""LoRA fine-tuning as a Stride Task: the hf_causal_lm example's GPT-2, loaded from a pretrained folder (init.from),
frozen, with low-rank adapters (Hugging Face `peft`) on its attention projections; only the adapters train.

The task is the sibling example's HFCausalLM (tokenising in `transform`, the tokenizer as a fact, the causal LM
loss, `generate`) with two changes:
  - `build_model` wraps the GPT-2 with `peft.get_peft_model`: every base parameter gets requires_grad=False (Stride
    then puts it in no optimizer group, and checkpoint.trainable_only leaves it out of checkpoints), and each
    targeted layer gains lora_A / lora_B (lora_B starts at zero: the wrapped model starts as the base).
  - `adapt_init_state` maps the names of a `save_pretrained` folder to PEFT's (below), so init.from needs no
    init.rename.

Import of the sibling: this module appends ../hf_causal_lm (found from this file's own location, so it works from
any working directory, and on every worker that sees this folder) to sys.path and imports hf_lm_task from there.
Appended, never prepended, as Stride does with the task's folder: an installed module of the same name would win.
Under Ray the workers import this file from the driver's working directory (STRIDE_TASK_PATH): on a cluster whose
nodes do not share the repository's folders, ship hf_lm_task.py beside this file (or copy it in) instead.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

from pydantic import Field, field_validator

_HF_CAUSAL_LM = str(Path(__file__).resolve().parent.parent / "hf_causal_lm")
if _HF_CAUSAL_LM not in sys.path:
    sys.path.append(_HF_CAUSAL_LM)

from hf_lm_task import HFCausalLM  # noqa: E402 - ../hf_causal_lm/hf_lm_task.py

# PEFT's names for a wrapped model: the base's names under this prefix, and a targeted layer's own tensors under
# `base_layer` (its adapters beside them: <layer>.lora_A.default.weight, <layer>.lora_B.default.weight).
PEFT_PREFIX = "base_model.model."
# GPT-2's Conv1D layers (weight stored (in, out): fan_in_fan_out=True), the layers LoRA may target here.
GPT2_CONV1D = ("c_attn", "c_proj", "c_fc")


class LoRACausalLM(HFCausalLM):
    class Config(HFCausalLM.Config):  # the model.<field> keys: HFCausalLM's (they must match the base) and LoRA's
        lora_r: int = Field(8, ge=1, description="Rank of each adapter (lora_A: r x in, lora_B: out x r)")
        lora_alpha: int = Field(16, ge=1, description="Adapter scale: its update is multiplied by lora_alpha / lora_r")
        lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input")
        target_modules: list[str] = Field(default_factory=lambda: ["c_attn"], min_length=1,
                                          description=f"GPT-2 layers that get adapters, of {', '.join(GPT2_CONV1D)} "
                                                      f"(c_attn: the fused q/k/v projection)")

        @field_validator("target_modules")
        @classmethod
        def _gpt2_layers(cls, v: list[str]) -> list[str]:
            if unknown := [t for t in v if t not in GPT2_CONV1D]:
                raise ValueError(f"has {unknown}, not GPT-2 layers LoRA can target here; use some of "
                                 f"{list(GPT2_CONV1D)}, e.g. model.target_modules=[c_attn,c_proj]")
            return v

    def build_base(self):
        """The plain GPT-2 (HFCausalLM's model), the one prepare.py pretrains and saves."""
        return super().build_model()

    def build_model(self):
        from peft import LoraConfig, get_peft_model

        c = self.config
        lora = LoraConfig(r=c.lora_r, lora_alpha=c.lora_alpha, lora_dropout=c.lora_dropout,
                          target_modules=list(c.target_modules), fan_in_fan_out=True, bias="none")
        with warnings.catch_warnings():  # peft asks transformers >= 5 a deprecated question; not the user's to fix
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
            return get_peft_model(self.build_base(), lora)

    def _targeted(self, module: str) -> bool:
        """PEFT's rule for a list of target_modules: the module's name is one, or ends with "." + one."""
        return any(module == t or module.endswith("." + t) for t in self.config.target_modules)

    def adapt_init_state(self, state):
        """save_pretrained's names -> the wrapped model's (called with meta tensors on the driver, real ones on the
        workers; names only, the tensors pass through):

            transformer.wte.weight               -> base_model.model.transformer.wte.weight
            transformer.h.0.attn.c_attn.weight   -> base_model.model.transformer.h.0.attn.c_attn.base_layer.weight
            transformer.h.0.attn.c_attn.bias     -> base_model.model.transformer.h.0.attn.c_attn.base_layer.bias

        The adapters (lora_A / lora_B) are in no such file: lora.yaml's init.exclude leaves them to their own init.
        Names already in PEFT's form (a Stride run of this task) pass through unchanged."""
        out = {}
        for name, tensor in state.items():
            if not name.startswith(PEFT_PREFIX):
                module, _, leaf = name.rpartition(".")
                if leaf in ("weight", "bias") and self._targeted(module):
                    name = f"{module}.base_layer.{leaf}"
                name = PEFT_PREFIX + name
            out[name] = tensor
        return out

    def blocks(self, model):
        return list(model.get_base_model().transformer.h)  # the GPT-2 blocks under the peft wrapper

    def flops_per_sample(self, model) -> float:
        """Forward 2N and the backward's activation gradients 2N over every parameter, the weight gradients 2N only
        over the trainable ones (the adapters), per token x context tokens."""
        total = sum(p.numel() for p in model.parameters())
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return (4.0 * total + 2.0 * trainable) * self.config.context
