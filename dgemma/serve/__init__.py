"""`dgemma serve`: an OpenAI- and ollama-compatible HTTP server over one engine.

app.py builds the app; a request goes from its route (openai/routes.py, ollama/routes.py) through
pipeline.py (a checked body to a running generation: prompts.py renders it, service.py runs it on
engine_thread.py's engine) to its answer (openai/responses.py or ollama/responses.py; text.py and
reasoning.py shape the text). By concern: http/ (the socket, who may connect, reading bodies),
openai/ (OpenAI's routes, bodies and answers), ollama/ (ollama's, translated into OpenAI's), tools/
(tool calling in Gemma 4's syntax), structured/ (response_format and the limits of every grammar),
media/ (where images and video may come from), playground/ (the page at GET /).
"""
