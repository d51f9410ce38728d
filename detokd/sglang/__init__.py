"""detokd as SGLang's detokenizer process: its IPC schema, plugin and process."""
