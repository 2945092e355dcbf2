"""The HTTP front end: FastAPI app, OpenAI protocol models and the TokenizerManager."""
