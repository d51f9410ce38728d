"""SGLang compatibility: a differential-test harness around SGLang's detokenizer process."""
