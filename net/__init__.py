"""The runtime's network faces: the Unix-socket server, its async client and framing."""
