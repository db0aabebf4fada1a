"""GET /v1/models and GET /v1/models/{model}"""

from fastapi import APIRouter

from app.openai.response_models import ModelCard, ModelList
from app.routes.deps import ReadyServing
from app.serving.service import OpenAIServing

router = APIRouter()


def _card(serving: OpenAIServing) -> ModelCard:
    return ModelCard(
        id=serving.model.name,
        created=serving.created,
        max_model_len=serving.model.info.max_model_len,
    )


@router.get("/v1/models")
async def list_models(serving: ReadyServing) -> ModelList:
    return ModelList(data=[_card(serving)])


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, serving: ReadyServing) -> ModelCard:
    serving.preparer.check_model(model)
    return _card(serving)
