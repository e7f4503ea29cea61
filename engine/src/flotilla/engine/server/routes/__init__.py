"""One APIRouter per endpoint group; app.py includes them all."""
