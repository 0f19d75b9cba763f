"""`POST /worker/models/load`: serve another model of the worker's folder (issue 37), by the worker's
`Swapper` (worker/slots/swapper.py), once the one served now has finished its streams.

Owns: the route and its documented answers (200 loaded, 202 loading, the refusals).
Must not: decide what loads where, or when (the swapper does).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from protocol import reasons
from protocol.worker import MODEL_LOAD_PATH, ErrorBody, ModelLoadAnswer, ModelLoadRequest
from worker.api.routes import authorize
from worker.errors import WorkerError
from worker.slots.swapper import Swapper

router = APIRouter()


@router.post(MODEL_LOAD_PATH, response_model=ModelLoadAnswer,
             responses={202: {"model": ModelLoadAnswer, "description": "the swap to it is under way"},
                        **{status: {"model": ErrorBody, "description": text} for status, text in {
                            400: "`invalid_request`: the model is `unavailable` or `too_large` (its reason named)",
                            401: "`unauthorized`", 404: "`unknown_model`: not in the worker's folder",
                            503: "`loading`; `model_swapping`: a swap to another model is under way; or "
                                 "`model_load_failed` (its reason; refused for a while)"}.items()}})
async def load(body: ModelLoadRequest, request: Request) -> JSONResponse:
    """Serve another model of the folder, once the one served now has finished its streams."""
    authorize(request)
    swapper: Swapper | None = getattr(request.app.state, "swapper", None)
    if swapper is None:
        raise WorkerError(reasons.LOADING, "the model is still loading")
    answer = swapper.load(body.model)
    return JSONResponse(answer.model_dump(), status_code=200 if answer.state == "loaded" else 202)
