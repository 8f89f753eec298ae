// Keep the reader's place when switching language: the language links carry the current
// #anchor to the same page in the other language (headings have the same ids in both).
(function () {
  function carryAnchor() {
    document.querySelectorAll("a.md-select__link[hreflang]").forEach(function (link) {
      if (!link.dataset.dmuonHref) {
        link.dataset.dmuonHref = link.getAttribute("href");
      }
      link.setAttribute("href", link.dataset.dmuonHref + window.location.hash);
    });
  }
  carryAnchor();
  window.addEventListener("hashchange", carryAnchor);
  // Capture phase: the link is up to date before any click handler navigates.
  document.addEventListener("click", carryAnchor, true);
})();
