"""The runtime's network faces: the Unix-socket server, its async client and framing (here), and
the HTTP server with its OpenAI- and Anthropic-compatible routes (`net.http`)."""
