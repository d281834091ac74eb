"""sparkdecode: a latency-specialized decode executor for Muse Spark under vLLM."""

__version__ = "0.1.0"
