// Retinue's live view: polls a cheap change marker and, when the registry
// changed, reloads this page's server-rendered (escaped) fragment in place.
// No framework, no inline script (the Content-Security-Policy forbids it).
(function () {
  "use strict";
  var main = document.getElementById("live");
  var status = document.getElementById("status");
  if (!main) { return; }
  var fragment = main.getAttribute("data-fragment");
  var marker = null;
  function setStatus(text, cls) {
    if (status) { status.textContent = text; status.className = "status " + cls; }
  }
  function openDetails() {
    var open = [];
    main.querySelectorAll("details[open]").forEach(function (d, i) { open.push(i); });
    return open;
  }
  function reload() {
    return fetch(fragment, { cache: "no-store", credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.text() : Promise.reject(r.status); })
      .then(function (html) {
        var open = openDetails();
        main.innerHTML = html;
        var all = main.querySelectorAll("details");
        open.forEach(function (i) { if (all[i]) { all[i].open = true; } });
      });
  }
  function tick() {
    fetch("/api/marker", { cache: "no-store", credentials: "same-origin" })
      .then(function (r) { return r.ok ? r.json() : Promise.reject(r.status); })
      .then(function (j) {
        var changed = marker !== null && j.marker !== marker;
        marker = j.marker;
        document.body.setAttribute("data-marker", marker);
        setStatus("live", "ok");
        return changed && fragment ? reload() : null;
      })
      .catch(function () { setStatus("offline", "down"); })
      .then(function () { setTimeout(tick, 1000); });
  }
  tick();
})();
