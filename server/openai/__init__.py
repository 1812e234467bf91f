"""OpenAI protocol models, endpoint logic and logprobs JSON, shared by the HTTP server and run-batch."""
