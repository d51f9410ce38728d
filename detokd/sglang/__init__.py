"""detokd as SGLang's detokenizer: its IPC schema (schema), the plugin (plugin), and the
process SGLang starts (process). The replay harness the SGLang tests and benchmark drive a
detokenizer process with is detokrig.sglang_replay, outside the package."""
