"""What one answer asks for beyond its prompt, checked once: a :class:`GenerationRequest`.

Every front end builds one from what the user gave (the command line's flags, a server
request's fields, the chat app's settings) and passes it down unchanged: through the model's
worker, :class:`~mlx_dgemma.lockstep.ModelCalls` (across ``mlx.launch``'s ranks, as JSON),
``stream_generate`` and ``ChatSession.stream``. Its sampler settings are the registry's
parameters (:mod:`mlx_dgemma.params`), each checked against its rule when the request is built,
so an error reads the registry's rule text in every front end (each names the field as its
user knows it: :meth:`~mlx_dgemma.errors.ParameterError.restated`). The rules between
parameters need the model's defaults for the values a request leaves out: :meth:`resolve`.

Standard library only (the command line builds its request before MLX is imported).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from . import params as registry
from .canvas import CanvasTemplate
from .errors import ParameterError

if TYPE_CHECKING:
    from .sampler import SamplerParams

# what a request may set besides the registry's parameters: the sampler's token ids (the end of
# a turn, the padding; SamplerDefaults' other fields, tests/test_request.py holds them equal)
TOKEN_IDS: tuple[str, ...] = ("eos_token_id", "pad_token_id")


@dataclass(frozen=True)
class GenerationRequest:
    """One answer's settings: ``sampler`` holds the registry parameters given, as (name, value)
    pairs in the registry's order (every other parameter is the model's default); ``logprobs``
    (k >= 0) asks for the answer's log-probabilities with the k most likely tokens each;
    ``template`` fixes positions of the answer (:mod:`mlx_dgemma.canvas`). Build it with
    :meth:`of`; every field is checked when it is built."""

    sampler: tuple[tuple[str, Any], ...] = ()
    logprobs: int | None = None
    template: CanvasTemplate | None = None

    def __post_init__(self) -> None:
        names = [name for name, _ in self.sampler]
        known = {*(p.name for p in registry.PARAMS), *TOKEN_IDS}
        unknown = sorted(set(names) - known)
        if unknown:
            raise ParameterError(f"unknown generation parameter(s) {unknown}; known: {sorted(known)}",
                                 param=unknown[0])
        if len(set(names)) != len(names):
            raise ParameterError(f"generation parameters given twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
        for name, value in self.sampler:
            if value is None:
                raise ParameterError(f"{name} = None: leave it out for the model's default", param=name)
            registry.check_generation_field(name, value)
        k = self.logprobs
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ParameterError(f"logprobs: {k!r}; expected an integer >= 0 (the most likely tokens to report per "
                                 "position) or None", param="logprobs", rule="an integer >= 0")
        if self.template is not None and not isinstance(self.template, CanvasTemplate):
            raise ParameterError(f"template: expected a CanvasTemplate, got {type(self.template).__name__}",
                                 param="template")

    @classmethod
    def of(cls, sampler: Mapping[str, Any] | None = None, *, logprobs: int | None = None,
           template: CanvasTemplate | Iterable[Sequence[int]] | None = None,
           quality: str | None = None) -> GenerationRequest:
        """A request from sampler settings by name (None values: not given, the model's default),
        ``logprobs`` and ``template`` (a CanvasTemplate or its (position, token) pairs).
        ``quality``: a setting of the speed/quality dial (:data:`mlx_dgemma.params.QUALITIES`),
        its values under those of ``sampler``."""
        preset = dict(registry.quality(quality).settings) if quality is not None else {}
        merged = {**preset, **{k: v for k, v in (sampler or {}).items() if v is not None}}
        given = {k: tuple(v) if isinstance(v, list) else v for k, v in merged.items() if v is not None}
        order = {name: i for i, name in enumerate((*(p.name for p in registry.PARAMS), *TOKEN_IDS))}
        pairs = tuple(sorted(given.items(), key=lambda kv: order.get(kv[0], len(order))))
        return cls(pairs, logprobs, CanvasTemplate.of(template))

    @classmethod
    def build(cls, request: GenerationRequest | None, sampler: Mapping[str, Any], *,
              logprobs: int | None = None, template: Any = None, who: str = "stream_generate") -> GenerationRequest:
        """``request``, or one built from keyword settings (the public API's ``**params`` form);
        both at once is an error (which would win is not obvious)."""
        if request is None:
            return cls.of(sampler, logprobs=logprobs, template=template)
        if not isinstance(request, GenerationRequest):
            raise ParameterError(f"{who}: request must be a GenerationRequest, got {type(request).__name__}",
                                 param="request")
        extra = sorted(k for k, v in {**sampler, "logprobs": logprobs, "template": template}.items() if v is not None)
        if extra:
            raise ParameterError(f"{who}: give the settings in request= or as keywords, not both (got {extra} "
                                 "besides request=)", param=extra[0])
        return request

    @property
    def params(self) -> dict[str, Any]:
        """The sampler settings given, by name."""
        return dict(self.sampler)

    def get(self, name: str, default: Any = None) -> Any:
        """The setting ``name`` if given, else ``default``."""
        return next((v for k, v in self.sampler if k == name), default)

    def __contains__(self, name: object) -> bool:
        """Whether the sampler setting ``name`` is given."""
        return any(k == name for k, _ in self.sampler)

    def __getitem__(self, name: str) -> Any:
        """The sampler setting ``name`` (KeyError: not given, the model's default applies)."""
        for k, v in self.sampler:
            if k == name:
                return v
        raise KeyError(name)

    def with_params(self, **changes: Any) -> GenerationRequest:
        """This request with sampler settings changed (a None value removes the setting)."""
        merged = {**dict(self.sampler), **changes}
        return GenerationRequest.of({k: v for k, v in merged.items() if v is not None},
                                    logprobs=self.logprobs, template=self.template)

    def with_options(self, **changes: Any) -> GenerationRequest:
        """This request with ``logprobs`` or ``template`` changed (a template's pairs are read)."""
        if "template" in changes:
            changes["template"] = CanvasTemplate.of(changes["template"])
        return replace(self, **changes)

    def resolve(self, generation_config: Mapping[str, Any] | None) -> SamplerParams:
        """The sampler's parameters for this request: the model's defaults (its
        ``generation_config``) with these settings; the rules between fields are checked here,
        on the values in effect (the error names the field the request gave)."""
        from .sampler import SamplerParams

        return SamplerParams.from_config(dict(generation_config or {}), **dict(self.sampler))

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable form (:meth:`from_json` reads it back): what ``mlx.launch``'s
        broadcast carries to the other ranks."""
        return {"sampler": [list(kv) for kv in self.sampler], "logprobs": self.logprobs,
                "template": self.template.pairs() if self.template is not None else None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GenerationRequest:
        return cls(tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in data.get("sampler", ())),
                   data.get("logprobs"),
                   CanvasTemplate.of(data.get("template")))
