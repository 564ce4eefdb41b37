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

// Adapter upload with a progress bar: the same form post, sent by XHR so progress shows. The
// script asks for the outcome as JSON: a refusal is shown next to the form (the typed name and
// chosen files stay); an accepted adapter leads to the page, with its message and the new row.
function uploadOutcome(xhr) {
  const type = xhr.getResponseHeader("content-type") || "";
  if (type.startsWith("application/json")) {
    try {
      return JSON.parse(xhr.responseText);
    } catch (_) {
      return { error: `The upload failed (HTTP ${xhr.status}).` };
    }
  }
  // Not the upload's own answer: an error page (its message), or a redirect XHR followed
  // (signed out: the login page), which the browser should show itself.
  if (xhr.status < 400) return { location: xhr.responseURL };
  const page = new DOMParser().parseFromString(xhr.responseText, "text/html");
  const message = page.getElementById("error-message");
  return { error: message ? message.textContent : `The upload failed (HTTP ${xhr.status}).` };
}

for (const form of document.querySelectorAll("form[data-upload]")) {
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    const box = form.querySelector(".progress");
    const bar = form.querySelector("progress");
    const status = box.querySelector("[aria-live]");
    const outcome = form.querySelector("[data-outcome]");
    const button = form.querySelector('button[type="submit"]');
    const fail = (text) => {
      box.hidden = true;
      button.disabled = false;
      outcome.textContent = text;
      outcome.classList.add("error");
    };
    outcome.textContent = "";
    outcome.classList.remove("error");
    bar.value = 0;
    status.textContent = "Uploading...";
    box.hidden = false;
    button.disabled = true;
    const xhr = new XMLHttpRequest();
    xhr.open("POST", form.action);
    xhr.setRequestHeader("x-csrftoken", csrfToken());
    xhr.setRequestHeader("accept", "application/json");
    xhr.upload.addEventListener("progress", (e) => {
      if (!e.lengthComputable) return;
      const pct = Math.round((e.loaded / e.total) * 100);
      bar.value = pct;
      status.textContent = pct < 100 ? `Uploading: ${pct}%` : "Checking the adapter...";
    });
    xhr.addEventListener("load", () => {
      const result = uploadOutcome(xhr);
      if (result.error) {
        fail(result.error);
      } else {
        status.textContent = result.message || "Uploaded.";
        window.location.assign(result.location || window.location.href);
      }
    });
    xhr.addEventListener("error", () => {
      fail("The upload failed: the connection broke (or the server refused the files part-way); check the files and try again.");
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
