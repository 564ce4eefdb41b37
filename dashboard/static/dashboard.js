// Tokenmill dashboard: small progressive enhancements. Every page works without this file.
"use strict";

function csrfToken() {
  const meta = document.querySelector('meta[name="csrf-token"]');
  return meta ? meta.content : "";
}

// Irreversible actions ask first: a form with data-confirm posts only once the admin says yes.
// Listening in the capture phase, a refused submit never reaches the form's own handlers.
document.addEventListener("submit", (event) => {
  const form = event.target.closest("form[data-confirm]");
  if (!form || window.confirm(form.dataset.confirm)) return;
  event.preventDefault();
  event.stopPropagation();
}, true);

// "Copy" next to a new key's secret.
document.addEventListener("click", (event) => {
  const button = event.target.closest("[data-copy]");
  if (!button) return;
  const field = document.getElementById(button.dataset.copy);
  field.select();
  const done = () => { button.textContent = "Copied"; };
  if (navigator.clipboard) {
    navigator.clipboard.writeText(field.value).then(done, () => document.execCommand("copy") && done());
  } else if (document.execCommand("copy")) {
    done();
  }
});

// Adapter upload with a progress bar: the same form post, sent by XHR so progress shows.
for (const form of document.querySelectorAll("form[data-upload]")) {
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const box = form.querySelector(".progress");
    const bar = form.querySelector("progress");
    const status = form.querySelector("[aria-live]");
    const button = form.querySelector('button[type="submit"]');
    box.hidden = false;
    button.disabled = true;
    const xhr = new XMLHttpRequest();
    xhr.open("POST", form.action);
    xhr.setRequestHeader("x-csrftoken", csrfToken());
    xhr.upload.addEventListener("progress", (e) => {
      if (!e.lengthComputable) return;
      const pct = Math.round((e.loaded / e.total) * 100);
      bar.value = pct;
      status.textContent = pct < 100 ? `Uploading: ${pct}%` : "Checking the adapter...";
    });
    // The server answers with a redirect to the page (and its message), which XHR follows.
    xhr.addEventListener("load", () => { window.location.assign(xhr.responseURL || form.action); });
    xhr.addEventListener("error", () => {
      status.textContent = "The upload failed; check the connection and try again.";
      button.disabled = false;
    });
    xhr.send(new FormData(form));
  });
}

// Live workers: reload the table every few seconds while the page is visible.
for (const box of document.querySelectorAll("[data-refresh]")) {
  const refresh = async () => {
    if (document.hidden) return;
    try {
      const response = await fetch(box.dataset.refresh, { credentials: "same-origin" });
      if (response.ok && !response.redirected) box.innerHTML = await response.text();
    } catch (_) {
      // Offline for a moment: keep the last table.
    }
  };
  setInterval(refresh, 3000);
}
