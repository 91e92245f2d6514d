// idemproxy console: the little the pages do in the browser. No framework, nothing fetched
// from elsewhere; every page works without it.
"use strict";

// Auto-refresh: a checkbox with data-autorefresh="ID" re-reads this page every 5 s and
// swaps in the element ID, while the tab is visible and nothing in it has focus.
function autorefresh(box) {
  const id = box.dataset.autorefresh;
  setInterval(async () => {
    const target = document.getElementById(id);
    if (!box.checked || document.visibilityState !== "visible" || !target) return;
    if (target.contains(document.activeElement)) return;
    try {
      const response = await fetch(location.href, { headers: { Accept: "text/html" }, credentials: "same-origin" });
      if (!response.ok || response.redirected) return;
      const fresh = new DOMParser().parseFromString(await response.text(), "text/html").getElementById(id);
      if (fresh) target.replaceWith(fresh);
    } catch (error) {
      // the proxy restarted or the network blinked: try again at the next tick
    }
  }, 5000);
}

document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("[data-autorefresh]").forEach(autorefresh);
  document.querySelectorAll("a[data-back]").forEach((link) => link.addEventListener("click", (event) => {
    if (history.length > 1) { event.preventDefault(); history.back(); }
  }));
});
