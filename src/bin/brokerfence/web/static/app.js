// brokerfence dashboard: the live refresh. Every `data-refresh` seconds the page is fetched
// again and its <main> replaced (parsed by DOMParser: nothing in it runs). No refresh while a
// field has the focus or the tab is hidden. Forms with `data-confirm` ask first.
(function () {
  "use strict";
  var every = Number(document.body.getAttribute("data-refresh") || "0");
  var state = document.getElementById("refresh-state");
  function busy() {
    var a = document.activeElement;
    return a && (a.tagName === "INPUT" || a.tagName === "TEXTAREA" || a.tagName === "SELECT");
  }
  function tick() {
    if (document.hidden || busy()) {
      return;
    }
    fetch(window.location.href, { credentials: "same-origin", headers: { "X-Requested-With": "refresh" } })
      .then(function (r) {
        if (!r.ok) {
          throw new Error("HTTP " + r.status);
        }
        return r.text();
      })
      .then(function (text) {
        var fresh = new DOMParser().parseFromString(text, "text/html").querySelector("main");
        var old = document.querySelector("main");
        if (fresh && old) {
          old.replaceWith(fresh);
        }
        if (state) {
          state.textContent = "live " + new Date().toLocaleTimeString();
        }
      })
      .catch(function (e) {
        if (state) {
          state.textContent = "refresh failed (" + e.message + "), retrying";
        }
      });
  }
  if (every > 0) {
    window.setInterval(tick, every * 1000);
  }
  document.addEventListener("submit", function (e) {
    var ask = e.target.getAttribute("data-confirm");
    if (ask && !window.confirm(ask)) {
      e.preventDefault();
    }
  });
})();
