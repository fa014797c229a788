"""A request's one way into the runtime, whatever its protocol: :meth:`RequestPath.infer` takes the
protocol's codec and owns the whole sequence, so that REST ``/predict``, the Open Inference Protocol
over REST and over gRPC are each a codec and an adapter, and nothing else.

The sequence: room for the body in the body budget (held until the answer is encoded); the body read
and decoded, its model looked up once, its inputs planned (off the event loop when large); the run
(bucket, batcher, route); the answer encoded (off the loop when large). A refusal before the run is
counted under the model the request named, once known; the run counts its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from compiler.errors import JitServeError, NotFoundError

from ..models.registry import Registry, ServedModel
from .bodies import BodyBudget, BodyRoom, JsonParsers
from .inference import Inference, Job, Prediction

T = TypeVar("T")

INLINE_WORK_BYTES = 32 * 1024
"""Request bodies (or V2 JSON headers) up to this size are decoded on the event loop, and responses
encoded there; bigger ones on the inference pool, so that a large tensor never stalls other requests."""

Lookup = Callable[[str, str | None], ServedModel]
"""The served model ``name`` (at ``version``, None: whichever is served); 404 when it is not served."""


class Codec(Protocol):
    """One protocol's request and its answer, as the runtime's entry drives them."""

    model: str | None
    """The model the request names: outside its body (a URL, a gRPC field), else once its body is read."""
    size: int
    """The bytes its body takes in the body budget (declared, or the protocol's limit)."""

    async def read(self, parsers: JsonParsers) -> Any:
        """The body, read (and parsed, where parsing is the protocol's first step)."""

    def decode_work(self, body: Any) -> int:
        """The bytes decoding ``body`` handles: off the event loop past :data:`INLINE_WORK_BYTES`."""

    def decode(self, body: Any, lookup: Lookup) -> tuple[ServedModel, Any, Any]:
        """The served model (looked up once), its inputs, and what encoding the answer needs."""

    def encode(self, prediction: Prediction, context: Any) -> Any:
        """The answer on the protocol's wire."""


class RequestPath:
    def __init__(self, registry: Registry, inference: Inference, body_budget: BodyBudget, parsers: JsonParsers) -> None:
        self.registry = registry
        self.inference = inference
        self.body_budget = body_budget
        self.parsers = parsers

    async def infer(self, codec: Codec) -> tuple[Any, Prediction]:
        """Run one request of a protocol; returns its encoded answer and the prediction (its timing)."""
        async with BodyRoom(self.body_budget, codec.size, lambda exc: self.inference.reject(codec.model, exc)):
            try:
                body = await codec.read(self.parsers)
                work = codec.decode_work(body)
                job, context = await self.off_loop(work, self._prepare, codec, body, model=codec.model)
            except JitServeError as exc:
                self.inference.reject(codec.model, exc)
                raise
            del body
            prediction = await self.inference.run(job)
            encoded = await self.off_loop(prediction.nbytes, codec.encode, prediction, context, model=codec.model)
        return encoded, prediction

    def _prepare(self, codec: Codec, body: Any) -> tuple[Job, Any]:
        served, inputs, context = codec.decode(body, self.lookup)
        return self.inference.prepare(served, inputs), context

    def lookup(self, name: str, version: str | None = None) -> ServedModel:
        served = self.registry.get(name)
        if version is not None and version != str(served.record.version):
            raise NotFoundError(f"model {name!r} has no version {version!r}; it serves version {served.record.version}")
        return served

    async def off_loop(self, size: int, function: Callable[..., T], *args: Any, model: str | None = None) -> T:
        """Decode a request or encode a response: on the event loop when ``size`` (the bytes it handles)
        is small, else on the inference pool (a full pool is counted for ``model``)."""
        if size <= INLINE_WORK_BYTES:
            return function(*args)
        return await self.inference.offload(function, *args, model=model)
