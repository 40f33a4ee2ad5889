"""Voice pipeline: microphone -> streaming recognition -> routed answer -> clause-streamed speech.

Modules, one responsibility each:
  assets      locate the bundled models (Whisper tiny.en, Piper voice, Silero VAD)
  wavfile     read/write WAV with errors that say what to do
  audio_io    devices (by name or index), resampling, microphone/speaker/file endpoints
  vad         Silero VAD (streaming) and the endpointer state machine
  endofturn   end of turn: Smart Turn v3.2, the transcript cue, the adaptive wait
  asr         streaming recognizer (short-context Whisper + local agreement)
  tts         Piper synthesiser and the clause chunker
  dialogue    bounded conversation history, and which of it a prompt carries (the memory policy)
  timings     per-turn stage timestamps
  events      typed events the pipeline emits (an interruption is an event)
  options     the pipeline's options; engines: the models it drives, loaded once
  state       what the pipeline's stages share (the utterance, the reply playing), under one lock
  listener    stage: frames -> VAD -> the utterance; decodes: its Whisper jobs
  drafts      stage: prefill or a drafted reply from partial transcripts
  endpointing stage: each pause judged, the endpoint
  speaking    stage: the reply starts, plays, ends; barge-in
  reply       one answer (`Turn`): generation -> clauses -> Piper -> playback
  pipeline    the coordinator wiring the stages (VoicePipeline)
  turn_record a finished turn as one JSON record (`file --json`, the web app's page)
  app         the rich terminal UI of `tokenrouter-edge listen`
  cli         subcommands `devices`, `listen`, `file`
"""
