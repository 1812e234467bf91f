"""run-batch: OpenAI Batch JSONL reader/writer, resume, bounded runner."""
