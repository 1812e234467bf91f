"""One step = schedule -> execute -> update: LLMEngine, AsyncLLM, output processing."""
