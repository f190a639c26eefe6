"""Model architecture specifications (decoder-only transformers: Llama, Mistral, Mixtral, Qwen2).

Parameter counts are derived from the shapes, not typed in, so a user's own ``config.json`` is
counted the same way as the catalog's models. Per layer::

    attention   q: h×(H·d)  k,v: h×(K·d) each  o: (H·d)×h      (+ q,k,v biases if any)
    mlp         E experts × 3·h·i  (gate, up, down; SwiGLU)  + router h×E when E > 1
    norms       2·h
  plus embeddings V×h, an untied LM head V×h, and a final norm h.

(h hidden, H heads, K KV heads, d head dim, i intermediate, V vocab, E experts.)
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator


class ModelSpec(BaseModel):
    """One model, as ``models.yaml`` or a Hugging Face ``config.json`` describes it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9._-]*$")
    display_name: str
    hf_id: str | None = None
    architecture: str
    num_layers: PositiveInt
    hidden_size: PositiveInt
    num_attention_heads: PositiveInt
    num_kv_heads: PositiveInt
    head_dim: PositiveInt
    intermediate_size: PositiveInt
    vocab_size: PositiveInt
    max_context: PositiveInt
    num_experts: PositiveInt = 1
    experts_per_token: PositiveInt = 1
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    sources: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelSpec:
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.experts_per_token > self.num_experts:
            raise ValueError("experts_per_token cannot exceed num_experts")
        return self

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def attention_params_per_layer(self) -> int:
        h = self.hidden_size
        weights = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        biases = self.q_dim + 2 * self.kv_dim if self.attention_bias else 0
        return weights + biases

    def expert_params(self) -> int:
        """Parameters of one SwiGLU MLP (gate, up and down projections)."""
        return 3 * self.hidden_size * self.intermediate_size

    def mlp_params_per_layer(self, *, active_only: bool = False) -> int:
        experts = self.experts_per_token if active_only else self.num_experts
        router = self.hidden_size * self.num_experts if self.is_moe else 0
        return experts * self.expert_params() + router

    def embedding_params(self) -> int:
        """Input embedding plus LM head (shared when tied)."""
        table = self.vocab_size * self.hidden_size
        return table if self.tie_word_embeddings else 2 * table

    def param_count(self, *, active_only: bool = False) -> int:
        """Total parameters, or those one token touches (``active_only``, for MoE)."""
        per_layer = (
            self.attention_params_per_layer()
            + self.mlp_params_per_layer(active_only=active_only)
            + 2 * self.hidden_size
        )
        return self.num_layers * per_layer + self.embedding_params() + self.hidden_size

    @property
    def active_param_count(self) -> int:
        return self.param_count(active_only=True)
