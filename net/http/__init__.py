"""The OpenAI-compatible HTTP face: the app (`app`), its wire shapes (`openai_types`), the
mapping onto the runtime's requests and events (`mapping`) and the uvicorn server (`server`)."""
