"""kernelexec as an MCP server (``kernelexec mcp``), built on the official ``mcp`` SDK."""
