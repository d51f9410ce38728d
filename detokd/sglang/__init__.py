"""detokd as SGLang's detokenizer: its IPC schema (schema), the plugin (plugin), the process
SGLang starts (process), and a replay harness around any detokenizer process (replay)."""
