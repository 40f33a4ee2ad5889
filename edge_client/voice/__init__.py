"""Voice pipeline: microphone -> streaming recognition -> routed answer -> clause-streamed speech.

Modules, one responsibility each:
  assets      locate the bundled models (Whisper tiny.en, Piper voice, Silero VAD)
  wavfile     read/write WAV with errors that say what to do
  audio_io    devices (by name or index), resampling, microphone/speaker/file endpoints
  vad         Silero VAD (streaming) and the endpointer state machine
  endofturn   end of turn: Smart Turn v3.2, the transcript cue, the adaptive wait
  asr         streaming recognizer (short-context Whisper + local agreement)
  tts         Piper synthesiser and the clause chunker
  dialogue    bounded conversation history
  timings     per-turn stage timestamps
  events      typed events the pipeline emits (an interruption is an event)
  turn_record a finished turn as one JSON record (`file --json`, the web app's page)
  pipeline    the orchestrator tying the stages together
  app         the rich terminal UI of `tokenrouter-edge listen`
  cli         subcommands `devices`, `listen`, `file`
"""
