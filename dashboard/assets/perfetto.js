/* "Open in Perfetto UI": hand the trace to ui.perfetto.dev through its postMessage protocol.
 *
 * The window is opened synchronously inside the click (so pop-up blockers allow it); we then
 * post "PING" to it until it answers "PONG" (the UI is loaded and listening), and post
 * {perfetto: {buffer, title, fileName}} with the trace bytes fetched from this server.
 * See https://perfetto.dev/docs/visualization/deep-linking-to-perfetto-ui
 */
(function () {
  "use strict";
  var PING_MS = 100;
  var GIVE_UP_MS = 60000;

  function setStatus(text, tone) {
    var el = document.getElementById("perfetto-status");
    if (!el) return;
    el.textContent = text;
    el.className = "perfetto-status" + (tone ? " perfetto-status--" + tone : "");
  }

  function fetchBuffer(url) {
    return fetch(url, { credentials: "same-origin", cache: "no-store" }).then(function (r) {
      if (!r.ok) throw new Error("HTTP " + r.status);
      return r.arrayBuffer();
    });
  }

  function openInPerfetto(btn) {
    var origin = btn.dataset.perfettoOrigin;
    var win = window.open(btn.dataset.perfettoUrl, "_blank");
    if (!win) {
      setStatus("the browser blocked the Perfetto window: allow pop-ups for this page", "bad");
      return;
    }
    var buffer = fetchBuffer(btn.dataset.traceUrl);
    var started = Date.now();
    var timer = null;

    function stop() {
      window.clearInterval(timer);
      window.removeEventListener("message", onMessage);
    }

    function onMessage(evt) {
      if (evt.source !== win || evt.origin !== origin || evt.data !== "PONG") return;
      stop();
      buffer.then(function (bytes) {
        win.postMessage(
          { perfetto: { buffer: bytes, title: btn.dataset.title, fileName: btn.dataset.fileName } },
          origin
        );
        setStatus("sent " + (bytes.byteLength / 1e6).toFixed(2) + " MB to Perfetto UI", "ok");
      }).catch(function (err) {
        setStatus("could not read the trace: " + err.message, "bad");
      });
    }

    window.addEventListener("message", onMessage);
    timer = window.setInterval(function () {
      if (win.closed || Date.now() - started > GIVE_UP_MS) {
        stop();
        setStatus("Perfetto UI did not answer; use the download link and open the file there", "bad");
        return;
      }
      win.postMessage("PING", origin);
    }, PING_MS);
    setStatus("waiting for Perfetto UI…", "");
  }

  document.addEventListener("click", function (evt) {
    var btn = evt.target.closest ? evt.target.closest("[data-perfetto-url]") : null;
    if (!btn) return;
    evt.preventDefault();
    openInPerfetto(btn);
  });
  window.stepscopePerfetto = { open: openInPerfetto };
})();
