// Kiln console. Pages arrive without data; this script fetches their HTML fragments with the API
// token in the Authorization header. The token lives in sessionStorage (this tab only): it is never
// put in a URL, a cookie or the page. Fragments are rendered and escaped by the server.
"use strict";

(() => {
  const TOKEN_KEY = "kiln.console.token";
  const timers = new Map();

  const token = () => sessionStorage.getItem(TOKEN_KEY);
  const $ = (id) => document.getElementById(id);

  function say(text, isError) {
    const el = $("console-status");
    el.textContent = text;
    el.classList.toggle("error", Boolean(isError));
  }

  async function call(method, url, body) {
    const headers = { Accept: "text/html, application/json" };
    const t = token();
    if (t) headers.Authorization = `Bearer ${t}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    return fetch(url, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "omit",
      cache: "no-store",
      redirect: "error",
    });
  }

  function showTokenState() {
    const held = Boolean(token());
    $("token-form").hidden = held;
    $("token-held").hidden = !held;
  }

  function stop(el) {
    clearInterval(timers.get(el));
    timers.delete(el);
  }

  async function load(el) {
    if (!token() && !("public" in el.dataset)) {
      el.textContent = "Enter an API token (kiln admin create-token) to see this page.";
      return;
    }
    const query = el.dataset.query || "";
    let response;
    try {
      response = await call("GET", el.dataset.fragment + query);
    } catch (err) {
      say(`The API did not answer: ${err.message}`, true);
      return;
    }
    if (response.status === 401) {
      sessionStorage.removeItem(TOKEN_KEY);
      showTokenState();
      say("The API refused the token: enter a valid one.", true);
      el.textContent = "";
      return;
    }
    const type = response.headers.get("Content-Type") || "";
    if (!type.startsWith("text/html")) {
      say(`${el.dataset.fragment}: HTTP ${response.status}`, true);
      return;
    }
    el.innerHTML = await response.text(); // server-rendered, autoescaped HTML
    el.dataset.loaded = String(Date.now());
    el.dataset.loads = String(Number(el.dataset.loads || 0) + 1);
    if (el.querySelector("[data-final]")) stop(el);
    if (response.ok && !("public" in el.dataset)) say("", false);
  }

  function watch(el) {
    load(el);
    const every = Number(el.dataset.refresh || 0);
    if (every > 0 && !timers.has(el)) {
      timers.set(el, setInterval(() => { if (!document.hidden) load(el); }, every));
    }
  }

  function reloadAll() {
    document.querySelectorAll("[data-fragment]").forEach((el) => load(el));
  }

  function formQuery(form) {
    const params = new URLSearchParams();
    for (const [name, value] of new FormData(form)) if (value) params.append(name, value);
    const text = params.toString();
    return text ? `?${text}` : "";
  }

  function bindFilters() {
    document.querySelectorAll("form[data-filter-for]").forEach((form) => {
      const target = $(form.dataset.filterFor);
      const apply = (ev) => {
        if (ev) ev.preventDefault();
        target.dataset.query = formQuery(form);
        load(target);
      };
      form.addEventListener("submit", apply);
      form.addEventListener("change", apply);
    });
  }

  async function cancel(jobId, button) {
    button.disabled = true;
    const response = await call("POST", `/v1/conversions/${encodeURIComponent(jobId)}/cancel`);
    if (!response.ok) {
      const problem = await response.json().catch(() => ({ detail: `HTTP ${response.status}` }));
      say(`Cancel ${jobId}: ${problem.detail}`, true);
    } else {
      say(`Cancellation of ${jobId} requested.`, false);
    }
    reloadAll();
  }

  function conversionBody(form) {
    const data = new FormData(form);
    return {
      source: String(data.get("source") || "").trim(),
      targets: data.getAll("targets"),
      method: data.get("method"),
      tp: Number(data.get("tp") || 1),
      options: {
        fp8_scheme: data.get("fp8_scheme"),
        expert_parallel: data.get("expert_parallel") === "on",
      },
    };
  }

  function problemText(problem) {
    const detail = problem && problem.detail;
    if (Array.isArray(detail)) return detail.map((d) => `${(d.loc || []).join(".")}: ${d.msg}`).join("; ");
    return String(detail || "unknown error");
  }

  function bindNewConversion() {
    const form = $("new-conversion");
    if (!form) return;
    const planEl = $("plan");
    const submit = $("submit-conversion");
    const problem = $("submit-problem");
    let planned = null;
    form.addEventListener("input", () => { submit.disabled = true; planned = null; });
    $("show-plan").addEventListener("click", async () => {
      problem.hidden = true;
      if (!form.reportValidity()) return;
      const body = conversionBody(form);
      planEl.textContent = "Planning…";
      const response = await call("POST", "/console/fragments/plan", body);
      if (response.status === 401) { planEl.textContent = ""; say("Enter a valid API token first.", true); return; }
      const type = response.headers.get("Content-Type") || "";
      if (type.startsWith("text/html")) {
        planEl.innerHTML = await response.text();
      } else {
        planEl.textContent = `The plan failed: ${problemText(await response.json().catch(() => null))}`;
      }
      planned = response.ok ? JSON.stringify(body) : null;
      submit.disabled = !response.ok;
    });
    form.addEventListener("submit", async (ev) => {
      ev.preventDefault();
      const body = conversionBody(form);
      if (planned !== JSON.stringify(body)) { submit.disabled = true; return; }
      submit.disabled = true;
      const response = await call("POST", "/v1/conversions", body);
      const answer = await response.json().catch(() => null);
      if (response.status === 202 && answer && answer.id) {
        window.location.assign(`/console/jobs/${encodeURIComponent(answer.id)}`);
        return;
      }
      problem.textContent = `Not submitted: ${problemText(answer)}`;
      problem.hidden = false;
      submit.disabled = false;
    });
  }

  function bindToken() {
    $("token-form").addEventListener("submit", (ev) => {
      ev.preventDefault();
      const input = $("token-input");
      const value = input.value.trim();
      input.value = "";
      if (!value) return;
      sessionStorage.setItem(TOKEN_KEY, value);
      showTokenState();
      say("", false);
      reloadAll();
    });
    $("token-forget").addEventListener("click", () => {
      sessionStorage.removeItem(TOKEN_KEY);
      showTokenState();
      reloadAll();
    });
  }

  document.addEventListener("click", (ev) => {
    const button = ev.target.closest("button[data-cancel]");
    if (button) cancel(button.dataset.cancel, button);
  });

  document.addEventListener("DOMContentLoaded", () => {
    bindToken();
    showTokenState();
    bindFilters();
    bindNewConversion();
    const params = new URLSearchParams(window.location.search);
    document.querySelectorAll("form[data-filter-for]").forEach((form) => {
      for (const [name, value] of params) if (form.elements[name]) form.elements[name].value = value;
      $(form.dataset.filterFor).dataset.query = formQuery(form);
    });
    document.querySelectorAll("[data-fragment]").forEach(watch);
  });
})();
