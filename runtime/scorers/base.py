"""The scorer protocol: one batched ``score`` over a layer, and what the scorer needs to compute it."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from common.names import SCORER_NAMES
from common.policy_grammar import ATTENTION_SCORERS, COMPARABLE_SCORERS
from runtime.scorers.inputs import LayerInputs, Need


class Scorer(ABC):
    """Scores the retained tokens of every KV head of a layer (higher = keep).

    * :meth:`score` ``(inputs) -> [R, Hkv, n]`` float32, ``-inf`` on padding (``~inputs.valid``);
      ``+inf`` means never evict, NaN is refused by the engine;
    * :attr:`needs`: what the scorer reads beyond keys, values and positions (see
      :mod:`runtime.scorers.inputs`); the providers fill exactly those in;
    * :meth:`attention` (when ``yields_attention``): the estimate ``a_j [R, Hkv, n]`` of the
      attention future queries pay each token, for moment-informed eviction;
    * ``comparable``: True when scores of different heads are on one scale (log attention), so
      the ``global`` allocation may rank all heads' tokens together.

    A registered scorer's ``comparable`` and ``yields_attention`` are the vocabulary's
    (``common.policy_grammar.COMPARABLE_SCORERS`` / ``ATTENTION_SCORERS``, which the torch-free
    grammar checks policies with): set from its ``name`` when the class is defined, stated once.

    Which rows the scores keep (sinks, recent window, then the best-scored, ties to the newer
    token) is :mod:`runtime.compression.keep_rule`'s, not the scorer's.
    """

    name = "scorer"
    comparable = False
    yields_attention = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.name in SCORER_NAMES:
            cls.comparable = cls.name in COMPARABLE_SCORERS
            cls.yields_attention = cls.name in ATTENTION_SCORERS

    @property
    def needs(self) -> tuple[Need, ...]:
        return ()

    @abstractmethod
    def score(self, inputs: LayerInputs) -> torch.Tensor:
        """Scores ``[R, Hkv, n]`` float32 for every head of the layer (padding: ``-inf``)."""

    def score_parts(self, inputs: LayerInputs):
        """What :meth:`combine` turns into the scores: the part that scorers built with the same
        :meth:`parts_options` share (``runtime.compression.prefill.shared_scores`` computes it once for
        several policies).  By default the scores themselves."""
        return self.score(inputs)

    def combine(self, parts, valid: torch.Tensor) -> torch.Tensor:
        """The scores ``[R, Hkv, n]`` from :meth:`score_parts` of inputs whose live tokens are ``valid``
        bool ``[R, Hkv, n]`` (equal to :meth:`score` of them): nothing of the inputs is read again."""
        return parts

    @classmethod
    def parts_options(cls, options: dict) -> dict:
        """Of the options a scorer of this class is built with, what its :meth:`score_parts` depend
        on (two scorers with equal ones share them); by default every option."""
        return dict(options)

    def attention(self, inputs: LayerInputs) -> torch.Tensor:
        """The estimate ``a_j [R, Hkv, n]`` of the attention future queries pay each token."""
        raise TypeError(
            f"{self!r} gives no attention estimate (moment-informed eviction needs one: expected_attention or snapkv)"
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
