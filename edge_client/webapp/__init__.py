"""`tokenrouter-edge app`: the desktop assistant, a local page in the browser (docs/app.md).

settings   the user's settings file (~/.config/tokenrouter/app.json, mode 0600) and their validation
bridge     the browser as the pipeline's microphone and speaker (WebSocket `Source` and `Sink`),
           push-to-talk and dropped files as a gate in front of any source
core       models, generator and cloud target, loaded once; settings applied between answers
session    one tab's connection: its pipeline, events to the page, take-over by a second tab
server     the loopback HTTP/WebSocket server with the per-launch token
cli        the `app` subcommand
static/    the page (HTML, CSS, JS, audio worklets): no CDN, everything ships in the package
"""
